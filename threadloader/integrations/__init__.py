"""Integrations with code that builds its own loaders: the patch, ``run``, Accelerate, Lightning."""
