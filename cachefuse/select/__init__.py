"""Token selectors: one module per selector (`selector="<name>"` is select/<name>.py, built by
select/registry.py), the protocol they follow in select/base.py. Imports nothing: a package that imports
its own modules closes an import cycle with each of them."""
