//! Routing policies: which upstream gets a request.
