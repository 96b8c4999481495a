"""The SSH executor's console side: one connection per host, the SSH transport, bootstrap + preflight."""
