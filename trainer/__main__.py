"""`torchrun ... -m rankguard.trainer ARGS`"""

import sys

from .announce import announce

announce()  # before importing torch: the agent knows this worker from its first moment

from .train import main  # noqa: E402

sys.exit(main())
