"""Test-wide setup. Triton's interpreter must be chosen before anything imports triton
(sglang does at import time), so it is set here, before any test module is collected."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
