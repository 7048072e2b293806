from kvspec.testing import profiles

PROFILE = profiles.load()


def pytest_report_header(config):
    return f"kvspec hypothesis profile: {PROFILE} (CI set -> 'ci'; else KVSPEC_PROFILE or 'dev')"
