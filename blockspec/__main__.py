"""`python -m blockspec …` (what torchrun runs: `torchrun --nproc-per-node N -m blockspec train-draft …`)."""
import sys

from blockspec.cli import main

sys.exit(main())
