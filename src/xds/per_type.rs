//! A stream's state per type URL, as a short sorted list rather than a map.
//!
//! A stream speaks a handful of types. A `BTreeMap<String, _>` costs a node of ~370 bytes plus a
//! `String` per type on every stream; here type URLs are interned (one allocation per type in the
//! process) and the list holds exactly the types the stream speaks. Sorted by type URL, so
//! iteration order is what the map's was.

use super::names::{self, Name};

#[derive(Debug, Clone)]
pub struct PerType<T>(Vec<(Name, T)>);

impl<T> Default for PerType<T> {
    fn default() -> Self {
        PerType(Vec::new())
    }
}

impl<T> PerType<T> {
    fn find(&self, type_url: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(t, _)| (**t).cmp(type_url))
    }

    pub fn get(&self, type_url: &str) -> Option<&T> {
        self.find(type_url).ok().map(|i| &self.0[i].1)
    }

    pub fn get_mut(&mut self, type_url: &str) -> Option<&mut T> {
        self.find(type_url).ok().map(|i| &mut self.0[i].1)
    }

    pub fn contains_key(&self, type_url: &str) -> bool {
        self.find(type_url).is_ok()
    }

    /// The state of `type_url`, created empty the first time the stream names the type.
    pub fn or_default(&mut self, type_url: &str) -> &mut T
    where
        T: Default,
    {
        let i = match self.find(type_url) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (names::intern(type_url), T::default()));
                i
            }
        };
        &mut self.0[i].1
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Name, &T)> {
        self.0.iter().map(|(t, v)| (t, v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&Name, &mut T)> {
        self.0.iter_mut().map(|(t, v)| (&*t, v))
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|(_, v)| v)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.0.iter_mut().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_found_and_listed_in_type_url_order() {
        let mut types: PerType<u32> = PerType::default();
        *types.or_default("type.googleapis.com/b") += 1;
        *types.or_default("type.googleapis.com/a") += 10;
        *types.or_default("type.googleapis.com/b") += 1;
        assert_eq!(types.get("type.googleapis.com/b"), Some(&2));
        assert!(types.contains_key("type.googleapis.com/a"));
        assert!(types.get("type.googleapis.com/c").is_none());
        let listed: Vec<(&str, &u32)> = types.iter().map(|(t, v)| (&**t, v)).collect();
        assert_eq!(
            listed,
            [
                ("type.googleapis.com/a", &10),
                ("type.googleapis.com/b", &2)
            ]
        );
    }
}
