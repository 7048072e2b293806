"""What a verdict leaves behind, for both machines: report.json, the timeline page, the
straight-line and golden pytest files, and the re-run of a recorded trace."""
