"""``kvmem ui``: the planner as a web page and a JSON API on one port.

``query`` turns a URL's query string into `kvmem plan`'s flags (the CLI's own parser),
``view`` turns the plan into what the page draws, ``server`` serves both and the page's
files in ``static/`` with the standard library. Imports no torch and no engine.
"""
