from meshkit.cli import main

raise SystemExit(main())
