"""The `rapidfire` command line. One module per subcommand, each with ``add_parser(subparsers)``."""
