//! NAT table of the system netstack (placeholder; the NAT helper replaces this file).
