"""The virtual environment scripts/setup.sh fills with newer references (PyPI's torch 2.x,
transformers 5; its --with-torch-muon and --with-transformers5 options), for the Python tests
that compare llmtrain against them.

A test calls use_reference_venv() before importing torch: when the environment exists and the
test runs under another interpreter, the test restarts itself under the environment's python,
once (an environment variable stops a second restart). Without the environment the test goes on
under the interpreter it was started with and skips visibly if what it needs is missing.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-torch")
_RESTARTED = "LLMTRAIN_REFERENCE_VENV_RESTARTED"


def use_reference_venv():
    venv_python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(venv_python) or os.environ.get(_RESTARTED):
        return
    # sys.prefix, not the executable's path: a virtual environment's python is a link to the
    # system's, and only sys.prefix tells the two apart.
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    os.environ[_RESTARTED] = "1"
    os.execv(venv_python, [venv_python, *sys.argv])
