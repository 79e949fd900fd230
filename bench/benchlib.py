"""Shared by the benchmark scripts."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_fortunes(build):
    """data/fortunes (kmoe-prep --fortunes with BUILD's kmoe-prep) unless it is there; its path."""
    data = os.path.join(ROOT, "data", "fortunes")
    if not os.path.exists(os.path.join(data, "train.bin")):
        subprocess.run([os.path.join(build, "drivers", "kmoe-prep"), "--fortunes", "--out-dir",
                        data], check=True, cwd=ROOT, capture_output=True)
    return data
