"""Registrations of the CuTe DSL backend's implementations (none shipped for any op yet)."""
