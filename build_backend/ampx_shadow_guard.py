"""Installed by an editable install of ampx (see ampx_build.build_editable), run at start-up by a
.pth file: it explains the one way an editable install silently breaks.

An editable install leaves `ampx` off sys.path and finds it through setuptools' finder, which
runs after Python's own path search. So when Python starts in the folder that holds the source
checkout and that checkout's folder is itself named `ampx`, the path search finds that folder
first and, as it has no __init__.py, imports it as an empty namespace package: every use then
fails with "module 'ampx' has no attribute ...". (A regular install does not have this problem:
a real package on sys.path beats a namespace folder.) This finder runs before the path search,
for the name `ampx` alone, and turns that case into an ImportError that says what happened.
"""
import os
import sys
from importlib.machinery import PathFinder

NAME = "ampx"


def shadowing_checkout(spec):
    """The folder of a namespace spec for `ampx` that is an ampx source checkout, or None."""
    if spec is None or spec.origin is not None or not spec.submodule_search_locations:
        return None  # nothing found, or a real module or package: not this case
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, NAME, "__init__.py")):
            return folder
    return None


def hint(folder):
    return (f"`import ampx` found {folder}, an ampx source checkout, and imported that folder as an empty "
            "namespace package in place of the editable install of ampx, because Python was started in the "
            f"folder that holds it ({os.path.dirname(folder)}) or that folder is on sys.path. Start Python from "
            "another folder (inside the checkout works too), or rename the checkout folder.")


class ShadowGuard:
    """A meta path finder that only ever raises: it finds nothing itself."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != NAME or path is not None:
            return None
        folder = shadowing_checkout(PathFinder.find_spec(fullname))
        if folder is not None:
            raise ImportError(hint(folder), name=NAME)
        return None


def install():
    """Puts the guard first on sys.meta_path (the .pth line calls this at start-up)."""
    if ShadowGuard not in sys.meta_path:
        sys.meta_path.insert(0, ShadowGuard)
