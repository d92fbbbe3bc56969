"""Shared test helpers (naive_attention, mod_cases, mod_zoo) importable from subfolders."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
