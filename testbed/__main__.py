import os
import sys

try:
    from testbed.cli import main
except ImportError as e:      # python3 -m testbed with a python that lacks our packages
    from testbed._bootstrap import reexec
    reexec(e)                 # runs the command in the project's environment, or says how
    raise
os.environ.pop("NEZHA_TESTBED_REEXEC", None)   # imports work here: not for our children

sys.exit(main())
