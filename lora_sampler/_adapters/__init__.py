"""The adapter lifecycle: names, archive members and limits, extraction, publishing, resolution, the fleet."""
