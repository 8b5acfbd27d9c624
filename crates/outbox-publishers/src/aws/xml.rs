//! Just enough XML for the query protocol's answers (SNS, STS): the text of an element, and
//! the elements of a list. The answers' shapes are fixed and shallow, so no parser is needed.

/// The text of the first `<tag>` element, unescaped.
pub fn text(document: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = document.find(&open)? + open.len();
    let end = document[start..].find(&close)? + start;
    Some(unescape(&document[start..end]))
}

/// The inner text of every `<member>` of the first `<list>` element.
pub fn members<'a>(document: &'a str, list: &str) -> Vec<&'a str> {
    let open = format!("<{list}>");
    let close = format!("</{list}>");
    let Some(start) = document.find(&open).map(|i| i + open.len()) else {
        return Vec::new();
    };
    let end = document[start..]
        .find(&close)
        .map_or(document.len(), |i| i + start);
    document[start..end]
        .split("<member>")
        .skip(1)
        .map(|m| m.split("</member>").next().unwrap_or_default())
        .collect()
}

fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_answer_and_an_error() {
        let answer = "<PublishBatchResponse><PublishBatchResult><Successful><member><Id>0</Id>\
            </member></Successful><Failed><member><Id>1</Id><Code>InvalidParameter</Code>\
            <Message>a &lt;b&gt; &amp; c</Message><SenderFault>true</SenderFault></member>\
            </Failed></PublishBatchResult></PublishBatchResponse>";
        let failed = members(answer, "Failed");
        assert_eq!(failed.len(), 1);
        assert_eq!(text(failed[0], "Message").as_deref(), Some("a <b> & c"));
        assert_eq!(members(answer, "Successful").len(), 1);
        assert!(members(answer, "Nope").is_empty());
        assert_eq!(text(answer, "Absent"), None);
    }
}
