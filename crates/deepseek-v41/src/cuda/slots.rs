//! Slot lists for the cache inserts.

/// Makes the non-negative entries of `slots` unique by keeping, for every slot, only its LAST
/// occurrence (earlier ones become `-1`, i.e. skipped). This is what a ring cache needs when
/// one call holds more tokens of a sequence than the ring has rows: with slots `p mod W`, the
/// ring must end up holding the last `W` positions, as if the tokens had been written in order.
pub fn keep_last_writer(slots: &mut [i64]) {
    let mut seen = std::collections::HashSet::new();
    for s in slots.iter_mut().rev() {
        if *s >= 0 && !seen.insert(*s) {
            *s = -1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::keep_last_writer;

    #[test]
    fn keeps_only_the_last_occurrence() {
        let mut s = vec![0, 1, 2, 0, -1, 1, 3];
        keep_last_writer(&mut s);
        assert_eq!(s, vec![-1, -1, 2, 0, -1, 1, 3]);
    }
}
