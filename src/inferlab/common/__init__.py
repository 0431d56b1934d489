"""What every layer may import: errors, the bundled-model locator, units, host memory. Imports nothing else of inferlab."""
