//! Request and token limits per key and per tenant, in process or shared through Redis.
