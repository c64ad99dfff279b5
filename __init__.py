"""eagle3_runner: EAGLE-3 drafter pipelines from one validated YAML spec.

The repository root is this package (pyproject.toml `package-dir`); its top-level folders are its
subpackages, one per concern, each importable only under this name (`eagle3_runner.kernels`,
never `kernels`): the folders carry no `__init__.py`, so a folder named like another
distribution's top-level package (Hugging Face's `kernels`, which transformers >= 5.25 requires)
can never shadow it, nor be shadowed by it. DEVELOPERS.md "Layout" lists the rooms and the
one-way order of their imports (tests/test_imports.py).
"""
