"""``python -m meshkit.doctor`` is not a command: it points to ``meshkit doctor`` and exits 2."""

if __name__ == "__main__":  # a library package, not a command: it names its verb and exits 2
    from meshkit.verbs import not_a_command

    not_a_command("meshkit.doctor")
