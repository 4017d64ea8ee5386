"""Online mode: the HTTP process (its composition root, routes, middleware, protocol, quotas, URL fetching)."""
