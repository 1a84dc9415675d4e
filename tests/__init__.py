"""kvray's test suite (a package, so that its modules import shared helpers as
``tests.helpers.*`` without a sys.path hack; test modules never import each other)."""
