import sys

from pipeline.gpu_check import main

sys.exit(main())
