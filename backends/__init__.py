"""The lower layer: the backend protocol (base.py), the nouns that cross it (types.py), its errors
(errors.py), the recipe tables that choose a backend (backend_config.py and each backend's own NAME_config.py), and two
backends: local/ (torch + peft, in process) and tinker/ (the real SDK). Nothing here imports `runner`.
"""
