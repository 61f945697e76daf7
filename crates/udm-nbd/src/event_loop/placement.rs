//! Which loop serves a connection. A client's connections to one export share a loop: a
//! client that spreads its requests over several connections (a multipath's round-robin
//! paths, a multi-conn client) sends a burst as a piece down each, and on one loop the pieces
//! that arrived together are served in one wake-up, as one connection's burst would be. On
//! loops of their own each piece cost a wake-up, a receive and a send of its own: serving
//! round-robin over two paths took the storage daemon of `bench/multipath.py` about twice
//! the CPU per I/O of `linear` over one, and kept round-robin below `linear`. Other
//! clients, and the same client's other exports, still spread over the loops (the one
//! serving the fewest), and so does every fio job: each is a process of its own.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Attach, Loops, Message};
use crate::stream::ClientKey;

impl Loops {
    /// Hands a connection to the loop of its client's other connections to its export (see
    /// the module documentation), or else to the loop serving the fewest. Dealt in turn instead,
    /// connections that come and go (probes, short jobs) left long-lived ones piled on one
    /// loop while another stood idle.
    pub fn attach(&self, mut attach: Attach) {
        let party = attach
            .stream
            .client_process()
            .ok()
            .map(|client| Party::new(client, &attach.negotiated.name));
        let fewest = || {
            let count = |i: &usize| self.mailboxes[*i].connections.load(Ordering::Relaxed);
            (0..self.mailboxes.len())
                .min_by_key(count)
                .expect("at least one loop")
        };
        let (index, member) = self.placement.place(party, fewest);
        // The connection leaves its party when it is dropped, with the rest of its slot.
        attach.slot = Box::new((attach.slot, member));
        let mailbox = &self.mailboxes[index];
        mailbox.connections.fetch_add(1, Ordering::Relaxed);
        mailbox.post(Message::Attach(Box::new(attach)));
    }
}

/// One client's connections to one export.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Party {
    client: ClientKey,
    export: String,
}

impl Party {
    pub(super) fn new(client: ClientKey, export: &str) -> Party {
        Party {
            client,
            export: export.to_string(),
        }
    }
}

/// The loop a party's connections go to, and how many of them are attached.
struct Seat {
    event_loop: usize,
    connections: usize,
}

/// The parties with connections attached, and where.
#[derive(Default)]
pub(super) struct Placement {
    seats: Mutex<HashMap<Party, Seat>>,
}

/// A connection's place in its party (kept as long as the connection): once the last one
/// is gone the party's next connection goes wherever there is the least to do.
pub(super) struct Member {
    placement: Arc<Placement>,
    party: Party,
}

impl Placement {
    /// The loop for a connection of `party`: its party's, or `fewest()` for a party's first
    /// connection (or one whose client is unknown, which joins no party).
    pub(super) fn place(
        self: &Arc<Self>,
        party: Option<Party>,
        fewest: impl FnOnce() -> usize,
    ) -> (usize, Option<Member>) {
        let Some(party) = party else {
            return (fewest(), None);
        };
        let mut seats = self.seats.lock();
        let seat = seats.entry(party.clone()).or_insert_with(|| Seat {
            event_loop: fewest(),
            connections: 0,
        });
        seat.connections += 1;
        let member = Member {
            placement: self.clone(),
            party,
        };
        (seat.event_loop, Some(member))
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut seats = self.placement.seats.lock();
        if let Some(seat) = seats.get_mut(&self.party) {
            seat.connections -= 1;
            if seat.connections == 0 {
                seats.remove(&self.party);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn party(pid: i32, export: &str) -> Option<Party> {
        Some(Party::new(ClientKey::Pid(pid), export))
    }

    #[test]
    fn a_partys_connections_share_a_loop_until_the_last_is_gone() {
        let placement = Arc::new(Placement::default());
        let (first, a) = placement.place(party(1, "vol"), || 0);
        // The second connection goes where the first is, whatever has the fewest now.
        let (second, b) = placement.place(party(1, "vol"), || 1);
        assert_eq!((first, second), (0, 0));
        // Another export, another client, or an unknown one: the fewest.
        assert_eq!(placement.place(party(1, "other"), || 1).0, 1);
        assert_eq!(placement.place(party(2, "vol"), || 1).0, 1);
        assert_eq!(placement.place(None, || 1).0, 1);
        drop(a);
        assert_eq!(placement.place(party(1, "vol"), || 1).0, 0);
        drop(b);
        // The party is gone: a new connection of it starts afresh.
        assert_eq!(placement.place(party(1, "vol"), || 1).0, 1);
    }
}
