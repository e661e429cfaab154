import sys

from bench import tune

tune.MOSAIC_FORWARD[64] = [(64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 64, 4)]
tune.MOSAIC_FORWARD[128] = [(64, 128, 2), (64, 64, 2), (64, 64, 3)]
sys.exit(tune.main())
