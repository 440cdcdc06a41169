"""ZeRO stages 0-3 as strategies behind one small interface."""
