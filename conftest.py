# Repository-root conftest: puts the root on sys.path so tests can import `examples`.
