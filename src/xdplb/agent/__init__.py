"""The backend-side agent: it measures its host and reports to the controller over UDP.

May import: core, datapath (lazily, where host_tc's pins are read).
"""
