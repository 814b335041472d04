//! A small insertion-ordered map: the Python `dict` semantics the planner's outputs depend on.

use std::collections::HashMap;
use std::hash::Hash;

/// Keys keep the position of their first insertion; re-inserting updates the value
/// in place, and removing then re-inserting moves a key to the end, as a Python `dict` does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OrderedMap<K: Eq + Hash + Clone, V> {
    entries: Vec<(K, V)>,
    index: HashMap<K, usize>,
}

impl<K: Eq + Hash + Clone, V> Default for OrderedMap<K, V> {
    fn default() -> Self {
        OrderedMap {
            entries: Vec::new(),
            index: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone, V> OrderedMap<K, V> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub(crate) fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.index.contains_key(key)
    }

    /// Python's `d[key] = value`.
    pub(crate) fn insert(&mut self, key: K, value: V) {
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// Python's `d.setdefault(key, default)`, returning the value for update.
    pub(crate) fn entry_or(&mut self, key: K, default: V) -> &mut V {
        let i = match self.index.get(&key) {
            Some(&i) => i,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, default));
                self.entries.len() - 1
            }
        };
        &mut self.entries[i].1
    }

    /// Python's `del d[key]`; O(n) because later positions shift.
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = self.index.remove(key)?;
        let (_, value) = self.entries.remove(i);
        for (_, slot) in self.index.iter_mut() {
            if *slot > i {
                *slot -= 1;
            }
        }
        Some(value)
    }

    /// Keeps only the entries for which `keep` is true, in order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.entries.retain(|(k, v)| keep(k, v));
        self.index = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl<K: Eq + Hash + Clone, V> FromIterator<(K, V)> for OrderedMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut map = OrderedMap::new();
        for (k, v) in iter {
            map.insert(k, v);
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reinsertion_keeps_position_and_removal_moves_to_end() {
        let mut m: OrderedMap<&str, i32> = ["a", "b", "c"].into_iter().zip(0..).collect();
        m.insert("a", 9);
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), ["a", "b", "c"]);
        m.remove("a");
        m.insert("a", 1);
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), ["b", "c", "a"]);
        assert_eq!(m.get("c"), Some(&2));
    }
}
