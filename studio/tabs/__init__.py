"""One module per tab: a ``build(...)`` that lays out its components, wired to plain handlers tested without a
server."""
