"""`torchrun ... -m rankguard.trainer ARGS`"""

import sys

from .train import main

sys.exit(main())
