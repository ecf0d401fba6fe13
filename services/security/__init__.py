"""Who may reach the platform's ports: service credentials and per-job tokens for the
internal port (`internal.py`), and TLS certificates for every port (`tls.py`)."""
