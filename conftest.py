"""Pytest set-up shared by the tests and the doctests: plans are made, not read from the plan cache of the
machine running them (tests/test_plan_cache.py turns the cache on in a folder of its own)."""
import os

os.environ["AUTORECOMPUTE_CACHE"] = "off"
