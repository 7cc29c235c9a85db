"""The parameter server's process and its clients: the host, the shadow policy's lease dispenser, the
worker-side clients, the actor class and its snapshots.
"""
