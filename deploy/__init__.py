"""Deployment artefacts: the manifest generator and the offline validators (not part of the runtime)."""
