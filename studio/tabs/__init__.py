"""One module per tab of the studio; each has a ``build(...)`` that lays out its components and wires
them to plain handler functions (defined in the same module, tested without a server).

Tabs are built in order inside ``studio.app.build_app``; a tab that needs another's components
receives that tab's returned object. The two editors and the builder's state are shared by every
tab (:mod:`studio.tabs.editors`).
"""
