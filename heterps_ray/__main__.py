import sys

from heterps_ray.cli import main

sys.exit(main())
