"""Local datasets of a site (Camtrap DP 1.0 packages): :func:`edge_sdk.data.camtrap_dp.load_camtrap_dp`."""
