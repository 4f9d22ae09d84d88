"""One router per endpoint group; ``create_app`` includes them all."""
