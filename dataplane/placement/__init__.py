"""Choosing the origin inside a region: sessions, shared prefixes and live load."""
