"""Privacy mechanisms of the gateway: Poisson sampling, the CCDP mechanism, and the randomness they draw on."""
