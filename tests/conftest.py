"""Shared by every tier: the lab fixtures (``lab``, ``lab_factory``) for e2e tests."""

pytest_plugins = ["xdplb.lab.pytest_plugin"]
