"""tandem's kernels, imported as `tandem.kernels`.

From the repository root the working directory is on sys.path, and this folder would shadow the
PyPI package `kernels` (Hugging Face's kernel loader, which transformers imports when it is
installed). Imported by that bare name, the module therefore stands aside: it loads the package
found on the rest of sys.path in its place, or is absent (ModuleNotFoundError) as that package
would be when it is not installed."""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement hands back what sys.modules holds now
    _spec.loader.exec_module(_module)
