"""The documentation site's tooling: the generated reference pages and the MkDocs hooks."""
