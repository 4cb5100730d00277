"""Transports: one abstract interface (base.py), one file per way of moving bytes."""
