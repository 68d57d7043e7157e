import sys

from rapidfire_hf.cli.main import main

sys.exit(main())
