"""The `depthbench` command line and its subcommands."""
