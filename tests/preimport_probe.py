"""What tests/test_preimported.py's interpreters import: like torch's inductor, it sets a variable as it is imported."""

import os

os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
