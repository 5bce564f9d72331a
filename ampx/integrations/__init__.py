"""Adapters that put ampx inside training frameworks, one module per framework.

- ``ampx.integrations.accelerate``: Hugging Face Accelerate.
- ``ampx.integrations.transformers``: the Transformers ``Trainer``.
- ``ampx.integrations.lightning``: PyTorch Lightning.
- ``ampx.integrations.timm``: timm's train loop (``NativeScaler``, ``hold_on_skip``).
- ``ampx.integrations.torchtune``: torchtune's full-finetune recipes (``RecipePrecision``).

Every framework is optional: importing ``ampx`` or this package never imports one. A module here
imports its framework when it is itself imported, and says which extra to install when the
framework is missing (``pip install ampx[accelerate]`` and so on).
"""
import importlib

__all__ = ["require"]


def require(module, extra):
    """Import and return ``module``; when it is missing, raise an ImportError naming ``extra``.

    ``extra`` is the name of the ampx extra that installs it (``"accelerate"``, ``"transformers"``,
    ``"lightning"``, ``"timm"``, ``"torchtune"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"ampx.integrations.{extra} needs the '{module}' package, which is not installed: "
            f"install it with `pip install ampx[{extra}]`") from exc
